"""rankwatch.dashboard: the Streamlit incident dashboard (a later issue)."""

__all__: list[str] = []
