"""rankwatch.dashboard: the Streamlit incident dashboard (`rankwatch dashboard RUN_DIR ...`) on top of
`rankwatch.analytics.views`; `serve` starts it bound to loopback."""

__all__: list[str] = []
