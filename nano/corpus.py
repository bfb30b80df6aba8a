"""Real English text that needs no download: the language reference topics that ship with
Python itself (pydoc_data, the text behind help()), whatever the running Python ships. The
engine calibrates int8 key scales on it at load (kv_calibration.py); the lab's int8 accuracy
measurement scores other topics of it (nano/lab/scoring.py)."""
CALIBRATION_TOPICS = ("objects", "naming")


def english_text(topic: str) -> str:
    from pydoc_data.topics import topics  # 0.5 MB of text: loaded only when asked for
    return topics[topic]
