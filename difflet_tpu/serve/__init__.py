"""A resident server for one pipeline folder (`python -m difflet_tpu.serve PATH`): OpenAI's
image and video endpoints over a bounded queue that batches compatible requests
(difflet_tpu.serve.engine, .backend, .app; docs/serving.md)."""
