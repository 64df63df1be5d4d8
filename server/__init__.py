"""The gateway: HTTP -> auth -> services -> jobqueue/db. Never imports torch or workers/."""
