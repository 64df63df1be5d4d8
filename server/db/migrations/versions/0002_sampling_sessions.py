"""Sampling sessions: the immutable weights each SamplingClient samples from.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sampling_sessions",
        sa.Column("id", sa.String(256), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("session_id", sa.String(64), sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("model_path", sa.String(1024), nullable=True),
        sa.Column("storage_key", sa.String(1024), nullable=True),
        sa.Column("weights_version", sa.String(256), nullable=True),
        sa.Column("source_model_id", sa.String(128), nullable=True),
        sa.Column("ephemeral", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("session_id", "seq_id"),
    )
    op.create_index("ix_sampling_sessions_session_id", "sampling_sessions", ["session_id"])
    op.create_index("ix_sampling_sessions_tenant_id", "sampling_sessions", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_sampling_sessions_tenant_id", table_name="sampling_sessions")
    op.drop_index("ix_sampling_sessions_session_id", table_name="sampling_sessions")
    op.drop_table("sampling_sessions")
