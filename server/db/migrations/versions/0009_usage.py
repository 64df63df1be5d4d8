"""Usage accounting: the `usage` table (tokens per tenant, one row per gateway flush; server/services/usage.py).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tokens_trained", sa.BigInteger(), nullable=False),
        sa.Column("tokens_forward", sa.BigInteger(), nullable=False),
        sa.Column("tokens_sampled", sa.BigInteger(), nullable=False),
        sa.Column("tokens_prefilled", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_usage_tenant_id", "usage", ["tenant_id"])
    op.create_index("ix_usage_recorded_at", "usage", ["recorded_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_recorded_at", table_name="usage")
    op.drop_index("ix_usage_tenant_id", table_name="usage")
    op.drop_table("usage")
