"""JSON types of the Tinker API (tolerant of unknown fields) and protobuf helpers."""
