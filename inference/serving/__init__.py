"""`semoe serve`: the OpenAI-compatible HTTP server (`http_server`), its wire format
(`openai_protocol`), the continuous-batching scheduler (`batch_scheduler`, `scheduler_events`),
prompt-prefix reuse, text streaming with stop strings, and the engine over the torch-free runner
(`torch_free_engine`)."""
