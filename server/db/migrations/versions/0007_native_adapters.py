"""The native protocol: `native_adapters` (a twinkle client's adapter settings and progress) and
`checkpoints.trainer_state` (the progress a native save with optimizer state records).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    if "trainer_state" not in {c["name"] for c in inspector.get_columns("checkpoints")}:
        with op.batch_alter_table("checkpoints") as batch:  # batch mode: SQLite cannot ALTER in place
            batch.add_column(sa.Column("trainer_state", sa.JSON(), nullable=True))
    if not inspector.has_table("native_adapters"):  # a database adopted from create_all may have it
        op.create_table(
            "native_adapters",
            sa.Column("model_id", sa.String(128), sa.ForeignKey("models.id"), primary_key=True),
            sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
            sa.Column("session_id", sa.String(64), sa.ForeignKey("sessions.id"), nullable=False),
            sa.Column("adapter_name", sa.String(64), nullable=False),
            sa.Column("next_seq", sa.Integer(), nullable=False),
            sa.Column("settings", sa.JSON(), nullable=False),
            sa.Column("progress", sa.JSON(), nullable=False),
            sa.UniqueConstraint("session_id", "adapter_name"),
        )
        op.create_index("ix_native_adapters_session_id", "native_adapters", ["session_id"])
        op.create_index("ix_native_adapters_tenant_id", "native_adapters", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_native_adapters_tenant_id", table_name="native_adapters")
    op.drop_index("ix_native_adapters_session_id", table_name="native_adapters")
    op.drop_table("native_adapters")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("trainer_state")
