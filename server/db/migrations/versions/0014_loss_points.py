"""Loss curves that survive a restart: the `loss_points` table (server/services/loss_history.py), the newest
points of each training run, written by the gateways in batches.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if "loss_points" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "loss_points",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("model_id", sa.String(128), nullable=False),
        sa.Column("seq_id", sa.BigInteger(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_loss_points_model_seq", "loss_points", ["model_id", "seq_id"])


def downgrade() -> None:
    op.drop_index("ix_loss_points_model_seq", table_name="loss_points")
    op.drop_table("loss_points")
