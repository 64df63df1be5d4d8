"""Hub push progress: `hub_pushes.bytes_done` and `bytes_total` (server/services/hub_push.py writes them while an
upload runs; the client polls them with the push's status).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_COLUMNS = ("bytes_done", "bytes_total")


def upgrade() -> None:
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("hub_pushes")}
    with op.batch_alter_table("hub_pushes") as batch:  # batch mode: SQLite cannot ALTER in place
        for name in _COLUMNS:
            if name not in present:
                batch.add_column(sa.Column(name, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hub_pushes") as batch:
        for name in _COLUMNS:
            batch.drop_column(name)
