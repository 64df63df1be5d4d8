"""Operator keys: `api_keys.admin` (an operator's key sees every tenant in the dashboard, server/api/dashboard.py).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    if "admin" not in {c["name"] for c in inspector.get_columns("api_keys")}:
        with op.batch_alter_table("api_keys") as batch:  # batch mode: SQLite cannot ALTER in place
            batch.add_column(sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("admin")
