"""Models of ended sessions are released: `models.released_at`.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A database adopted from create_all (server/db/database.py) may have the column already.
    if "released_at" in {c["name"] for c in sa.inspect(op.get_bind()).get_columns("models")}:
        return
    with op.batch_alter_table("models") as batch:  # batch mode: SQLite cannot ALTER a column in place
        batch.add_column(sa.Column("released_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("released_at")
