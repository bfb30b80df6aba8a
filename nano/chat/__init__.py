"""Chat templates (template.py): conversations into prompt text, for nano/cli and nano/server."""
