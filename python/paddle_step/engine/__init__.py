"""The continuous-batching engine: ``llm_engine.Engine`` drives the ``scheduler`` (host
bookkeeping), the ``model_runner`` (device step over the ``slot_state``) and both ops;
``core_proc`` runs it in a process of its own for the server, ``core_client`` is the
server's side of that process."""
