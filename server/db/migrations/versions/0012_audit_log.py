"""Keys and audit: `api_keys.expires_at` (a rotated key's grace period) and `changed_at`, the tenants' request
rate quotas (`tenant_quotas.requests_per_minute`, `request_burst`) and the `audit_log` table
(server/services/audit.py).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_COLUMNS = {"api_keys": ("expires_at", "changed_at"), "tenant_quotas": ("requests_per_minute", "request_burst")}


def _column(table: str, name: str) -> sa.Column[object]:
    kind = sa.DateTime(timezone=True) if table == "api_keys" else sa.Integer()
    return sa.Column(name, kind, nullable=True)


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    for table, names in _COLUMNS.items():
        present = {c["name"] for c in inspector.get_columns(table)}
        with op.batch_alter_table(table) as batch:  # batch mode: SQLite cannot ALTER in place
            for name in names:
                if name not in present:
                    batch.add_column(_column(table, name))
    if "audit_log" in inspector.get_table_names():
        return
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(512), nullable=True),
        sa.Column("request_id", sa.String(128), nullable=True),
        sa.Column("client", sa.String(128), nullable=True),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ix_audit_log_tenant_id", "audit_log", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_audit_log_tenant_id", table_name="audit_log")
    op.drop_index("ix_audit_log_at", table_name="audit_log")
    op.drop_table("audit_log")
    for table, names in _COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for name in names:
                batch.drop_column(name)
