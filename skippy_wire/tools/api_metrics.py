"""``GET /metrics`` of ``api``: its request counters and lane gauges in Prometheus's text
format (version 0.0.4), those llama-server also counts under its names too."""

from __future__ import annotations

#: The media type of Prometheus's text format.
PROMETHEUS_TEXT = "text/plain; version=0.0.4"


def prometheus_text(counters, admission) -> str:
    """The exposition of the engine's ``counters`` and the lanes and queue of ``admission``."""
    c, a = counters, admission
    rows = [
        ("skippy_requests_total", "counter", "Generations ended (each choice of each prompt; completed, failed or "
         "cancelled), and requests whose client left while queued", c["requests"]),
        ("skippy_requests_failed_total", "counter", "Requests that failed in the pipeline", c["failed"]),
        ("skippy_requests_cancelled_total", "counter", "Of those, cancelled by their client", c["cancelled"]),
        ("skippy_requests_rejected_total", "counter",
         "Requests refused as queue_full (the lanes' queue or the tokenizer's was full)", c["rejected"]),
        ("skippy_prompt_tokens_total", "counter", "Prompt tokens, once per generation", c["prompt_tokens"]),
        ("skippy_completion_tokens_total", "counter", "Tokens generated", c["completion_tokens"]),
        ("skippy_requests_running", "gauge", "Requests holding a lane", a.running - a.borrowed),
        ("skippy_lanes_busy", "gauge", "Lanes generating (a request may borrow idle ones)", a.running),
        ("skippy_queue_depth", "gauge", "Requests waiting for a lane", a.waiting),
        # the same figures under llama-server's names, for the dashboards and scrapers written for it
        ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", c["prompt_tokens"]),
        ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.",
         c["completion_tokens"]),
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.", a.running),  # its busy slots
        ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", a.waiting),
    ]
    lines = [line for name, kind, help_, value in rows
             for line in (f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}")]
    lines += ["# HELP skippy_hop_bytes_total Bytes on the driver's hop to stage 0",
              "# TYPE skippy_hop_bytes_total counter",
              f'skippy_hop_bytes_total{{hop="0",direction="sent"}} {c["sent_bytes"]}',
              f'skippy_hop_bytes_total{{hop="0",direction="received"}} {c["received_bytes"]}']
    return "\n".join(lines) + "\n"


__all__ = ["PROMETHEUS_TEXT", "prometheus_text"]
