"""Hub push: per-tenant encrypted hub tokens, push records, per-run auto-push settings.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "hub_tokens",
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("provider", sa.String(32), primary_key=True),
        sa.Column("ciphertext", sa.String(4096), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_table(
        "hub_pushes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("tinker_path", sa.String(1024), nullable=False),
        sa.Column("storage_key", sa.String(1024), nullable=False),
        sa.Column("provider", sa.String(32), nullable=False),
        sa.Column("repo_id", sa.String(256), nullable=False),
        sa.Column("private", sa.Boolean(), nullable=False),
        sa.Column("trigger", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.String(2048), nullable=True),
        sa.Column("url", sa.String(1024), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("finished_at", _TS, nullable=True),
    )
    op.create_index("ix_hub_pushes_tenant_id", "hub_pushes", ["tenant_id"])
    op.create_table(
        "auto_pushes",
        sa.Column("model_id", sa.String(128), sa.ForeignKey("models.id"), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("provider", sa.String(32), nullable=False),
        sa.Column("repo_id", sa.String(256), nullable=False),
        sa.Column("private", sa.Boolean(), nullable=False),
        sa.Column("push_id", sa.String(64), nullable=True),
    )
    op.create_index("ix_auto_pushes_tenant_id", "auto_pushes", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_auto_pushes_tenant_id", table_name="auto_pushes")
    op.drop_table("auto_pushes")
    op.drop_index("ix_hub_pushes_tenant_id", table_name="hub_pushes")
    op.drop_table("hub_pushes")
    op.drop_table("hub_tokens")
