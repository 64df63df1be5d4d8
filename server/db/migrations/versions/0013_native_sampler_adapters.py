"""The native protocol's sampler adapters: `native_sampler_adapters` (the LoRA slots a session added with
add_adapter_to_sampler: name and config, no weights).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if sa.inspect(op.get_bind()).has_table("native_sampler_adapters"):  # a database adopted from create_all
        return
    op.create_table(
        "native_sampler_adapters",
        sa.Column("session_id", sa.String(64), sa.ForeignKey("sessions.id"), primary_key=True),
        sa.Column("base_model", sa.String(256), primary_key=True),
        sa.Column("adapter_name", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("lora", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_native_sampler_adapters_tenant_id", "native_sampler_adapters", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_native_sampler_adapters_tenant_id", table_name="native_sampler_adapters")
    op.drop_table("native_sampler_adapters")
