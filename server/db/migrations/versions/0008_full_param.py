"""Full-parameter runs: `models.full_param` (a private trainable copy of the base model instead of a LoRA).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    if "full_param" not in {c["name"] for c in inspector.get_columns("models")}:
        with op.batch_alter_table("models") as batch:  # batch mode: SQLite cannot ALTER in place
            batch.add_column(sa.Column("full_param", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("full_param")
