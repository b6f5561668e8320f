"""The OpenAI-compatible HTTP server (`specserve serve`): FastAPI + uvicorn over AsyncLLMEngine.

protocol.py request bodies -> serving.py runs them (JSON or SSE) -> app.py routes, key, queue, drain gate;
errors.py OpenAI-shaped errors; metrics.py Prometheus; launch.py uvicorn with a SIGTERM drain; cli.py flags.
"""
