"""The `indexpool` command line: Typer app, document ingestion and tasks."""
