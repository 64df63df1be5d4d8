"""SQLAlchemy 2.0 rows. Only repositories read and write them; services get rows, routes get wire types."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SQL_INT_MAX = 2**31 - 1  # the largest id, offset or count an INTEGER column or parameter holds (Postgres, SQLite)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class TenantRow(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)
    prefix: Mapped[str] = mapped_column(String(32))  # first characters, to recognise a key in listings
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # an operator's key (`keys create --admin`): the dashboard shows it every tenant (migration 0010)
    admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # migration 0012: a rotated key works until `expires_at` (its grace period); `changed_at` is the last create,
    # rotate or revoke of the key (a gateway without Redis watches its max, server/auth/keys.py)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    changed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    finish_detail: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    project_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    display_name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    sdk_version: Mapped[str | None] = mapped_column(String(32), nullable=True)


class ModelRow(Base):
    """A training run: one LoRA adapter (or one full-parameter copy) of one tenant on one base model."""

    __tablename__ = "models"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # "{session_id}:train:{model_seq_id}"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    model_seq_id: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(256))
    lora_rank: Mapped[int] = mapped_column(Integer)  # 0 for a full-parameter run
    # a full-parameter run: a private trainable copy of the base model, on a lease (server/services/full_param.py)
    full_param: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    seed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    train_attn: Mapped[bool] = mapped_column(Boolean, default=True)
    train_mlp: Mapped[bool] = mapped_column(Boolean, default=True)
    train_unembed: Mapped[bool] = mapped_column(Boolean, default=True)
    optimizer: Mapped[str] = mapped_column(String(32), default="adamw")
    create_request_id: Mapped[str] = mapped_column(String(64))
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_request_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Set once its session ended and the workers were told to free it; its requests then get 410.
    released_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    __table_args__ = (UniqueConstraint("session_id", "model_seq_id"),)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), index=True)
    kind: Mapped[str] = mapped_column(String(32))  # weights | sampler_weights | external_weights
    name: Mapped[str] = mapped_column(String(256))
    storage_key: Mapped[str] = mapped_column(String(1024))
    request_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | ready | failed
    size_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # a native client's save(save_optimizer=True): its trainer progress (cur_step, consumed_train_samples, ...)
    trainer_state: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    __table_args__ = (UniqueConstraint("model_id", "kind", "name"),)

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"


class NativeAdapterRow(Base):
    """A native (twinkle client) adapter: the training model its session names `adapter_name`, the settings the
    native protocol keeps per adapter (loss, optimizer, scheduler, metrics, template, accumulation) and its
    progress (backwards, steps, the open accumulation window, metric sums). server/services/native/adapters.py."""

    __tablename__ = "native_adapters"
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    adapter_name: Mapped[str] = mapped_column(String(64))
    next_seq: Mapped[int] = mapped_column(Integer, default=1)  # the model's next seq_id (0 was its creation)
    settings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    progress: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    __table_args__ = (UniqueConstraint("session_id", "adapter_name"),)


class NativeSamplerAdapterRow(Base):
    """A LoRA slot a native session added to a served model's sampler (`add_adapter_to_sampler`): its name and
    validated config, no weights (the protocol fills a slot by a weight sync this server does not offer), so sampling
    with its name samples the base model. Reachable only through its live session; deleted once the session ended.
    server/services/native/sampler_adapters.py, migration 0013."""

    __tablename__ = "native_sampler_adapters"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(256), primary_key=True)
    adapter_name: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    lora: Mapped[dict[str, Any]] = mapped_column(JSON)  # the LoraSpec's JSON
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SamplingSessionRow(Base):
    """A sampling session: the immutable weights one SamplingClient samples from (or the base model alone)."""

    __tablename__ = "sampling_sessions"
    id: Mapped[str] = mapped_column(String(256), primary_key=True)  # "{session_id}:sample:{sampling_session_seq_id}"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    seq_id: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(256))
    model_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)  # tinker:// path it was made from
    storage_key: Mapped[str | None] = mapped_column(String(1024), nullable=True)  # None: the base model alone
    weights_version: Mapped[str | None] = mapped_column(String(256), nullable=True)
    source_model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)  # training run of a save
    ephemeral: Mapped[bool] = mapped_column(Boolean, default=False)  # from save_weights_and_get_sampling_client
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (UniqueConstraint("session_id", "seq_id"),)


class HubTokenRow(Base):
    """A tenant's access token for a model hub, encrypted with the server secret (server/services/secrets.py)."""

    __tablename__ = "hub_tokens"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    provider: Mapped[str] = mapped_column(String(32), primary_key=True)  # huggingface | modelscope
    ciphertext: Mapped[str] = mapped_column(String(4096))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class HubPushRow(Base):
    """One upload of a checkpoint to a hub repository; the client polls its status."""

    __tablename__ = "hub_pushes"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    tinker_path: Mapped[str] = mapped_column(String(1024))
    storage_key: Mapped[str] = mapped_column(String(1024))
    provider: Mapped[str] = mapped_column(String(32))
    repo_id: Mapped[str] = mapped_column(String(256))
    private: Mapped[bool] = mapped_column(Boolean, default=True)
    trigger: Mapped[str] = mapped_column(String(16), default="request")  # request | auto
    status: Mapped[str] = mapped_column(String(16), default="queued")  # queued | running | succeeded | failed
    error: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    url: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    bytes_done: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # the upload's progress, while it runs
    bytes_total: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class AutoPushRow(Base):
    """Per-run setting: push the run's newest checkpoint when its session finishes."""

    __tablename__ = "auto_pushes"
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    provider: Mapped[str] = mapped_column(String(32))
    repo_id: Mapped[str] = mapped_column(String(256))
    private: Mapped[bool] = mapped_column(Boolean, default=True)
    push_id: Mapped[str | None] = mapped_column(String(64), nullable=True)  # set once triggered


class TenantQuotaRow(Base):
    """A tenant's limits (server/services/quotas.py); NULL means the server's default (server/config.py quota_*)."""

    __tablename__ = "tenant_quotas"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    max_models: Mapped[int | None] = mapped_column(Integer, nullable=True)  # live training runs
    max_resident_adapters: Mapped[int | None] = mapped_column(Integer, nullable=True)  # on the accelerator at once
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)  # training + sampling tokens
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)  # queued or running
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)  # HTTP requests (0012)
    request_burst: Mapped[int | None] = mapped_column(Integer, nullable=True)  # requests at once over the rate
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CustomLossRow(Base):
    """A custom loss uploaded with create_custom_loss: its checked graph (api_schemas.tinker.custom_loss), usable
    only by the session (and so the tenant) that created it."""

    __tablename__ = "custom_losses"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the loss_id, also its create future's id
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    seq_id: Mapped[int] = mapped_column(Integer)  # custom_loss_seq_id: a retried create finds this row
    name: Mapped[str] = mapped_column(String(128))
    digest: Mapped[str] = mapped_column(String(64))  # of what the loss computes: a retry must carry the same
    program: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (UniqueConstraint("session_id", "seq_id"),)


class UsageRow(Base):
    """Tokens one tenant's requests used since the previous row of the same gateway: a gateway's usage meter
    (server/services/usage.py) writes one row per tenant that used any, every maintenance round. Reports sum them."""

    __tablename__ = "usage"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0)  # forward_backward datums' tokens
    tokens_forward: Mapped[int] = mapped_column(BigInteger, default=0)  # forward-only datums' tokens
    tokens_sampled: Mapped[int] = mapped_column(BigInteger, default=0)  # generated tokens delivered
    tokens_prefilled: Mapped[int] = mapped_column(BigInteger, default=0)  # sample prompts' tokens


class AuditRow(Base):
    """One audited event (server/services/audit.py, migration 0012): a key's first use in a window, a key change
    or a destructive action. `key_id` is the acting key (None: an operator command); never the key itself."""

    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    key_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str | None] = mapped_column(String(512), nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    client: Mapped[str | None] = mapped_column(String(128), nullable=True)  # the client's address, or "cli"


class LossPointRow(Base):
    """One training step's loss for the dashboard's curve of a run (server/services/loss_history.py, migration
    0014): the `loss:sum` of a delivered training forward_backward. The gateways write them in batches each
    maintenance round and keep the newest `loss_history.POINTS` seq_ids per run."""

    __tablename__ = "loss_points"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    model_id: Mapped[str] = mapped_column(String(128))  # the training run (models.id)
    seq_id: Mapped[int] = mapped_column(BigInteger)  # the run's operation number: the curve's x axis
    loss: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # when the result was delivered
    __table_args__ = (Index("ix_loss_points_model_seq", "model_id", "seq_id"),)
