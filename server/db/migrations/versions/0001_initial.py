"""Initial schema: tenants, api_keys, sessions, models (training runs), checkpoints.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("created_at", _TS, nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("key_hash", sa.String(128), nullable=False, unique=True),
        sa.Column("prefix", sa.String(32), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("revoked_at", _TS, nullable=True),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("last_heartbeat_at", _TS, nullable=False),
        sa.Column("finished_at", _TS, nullable=True),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("finish_detail", sa.String(2048), nullable=True),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("project_id", sa.String(128), nullable=True),
        sa.Column("display_name", sa.String(256), nullable=True),
        sa.Column("sdk_version", sa.String(32), nullable=True),
    )
    op.create_index("ix_sessions_tenant_id", "sessions", ["tenant_id"])
    op.create_table(
        "models",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("session_id", sa.String(64), sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("model_seq_id", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=True),
        sa.Column("train_attn", sa.Boolean(), nullable=False),
        sa.Column("train_mlp", sa.Boolean(), nullable=False),
        sa.Column("train_unembed", sa.Boolean(), nullable=False),
        sa.Column("optimizer", sa.String(32), nullable=False),
        sa.Column("create_request_id", sa.String(64), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("last_request_at", _TS, nullable=False),
        sa.UniqueConstraint("session_id", "model_seq_id"),
    )
    op.create_index("ix_models_session_id", "models", ["session_id"])
    op.create_index("ix_models_tenant_id", "models", ["tenant_id"])
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("model_id", sa.String(128), sa.ForeignKey("models.id"), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("storage_key", sa.String(1024), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=True),
        sa.Column("public", sa.Boolean(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("expires_at", _TS, nullable=True),
        sa.UniqueConstraint("model_id", "kind", "name"),
    )
    op.create_index("ix_checkpoints_model_id", "checkpoints", ["model_id"])
    op.create_index("ix_checkpoints_tenant_id", "checkpoints", ["tenant_id"])


def downgrade() -> None:
    for table in ("checkpoints", "models", "sessions", "api_keys"):
        for index in {"checkpoints": ("model_id", "tenant_id"), "models": ("session_id", "tenant_id"),
                      "sessions": ("tenant_id",), "api_keys": ("tenant_id",)}[table]:
            op.drop_index(f"ix_{table}_{index}", table_name=table)
        op.drop_table(table)
    op.drop_table("tenants")
