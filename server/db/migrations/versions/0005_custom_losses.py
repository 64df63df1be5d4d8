"""Server-side custom losses: the checked graphs uploaded with create_custom_loss.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "custom_losses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("session_id", sa.String(64), sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("program", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("session_id", "seq_id"),
    )
    op.create_index("ix_custom_losses_session_id", "custom_losses", ["session_id"])
    op.create_index("ix_custom_losses_tenant_id", "custom_losses", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_custom_losses_tenant_id", table_name="custom_losses")
    op.drop_index("ix_custom_losses_session_id", table_name="custom_losses")
    op.drop_table("custom_losses")
