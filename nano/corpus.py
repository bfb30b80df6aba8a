"""Real English text that needs no download: the language reference topics that ship with
Python itself (pydoc_data, the text behind help()), prose with some code in it. The engine
uses it to calibrate int8 key scales at load (kv_calibration.py) and the int8 accuracy
measurement (nano/lab/scoring.py, the lab's kv-quant and gqa) scores the model on it. Calibration and evaluation use
different topics, so a scheme is never scored on the text it was calibrated on. The text
is whatever the running Python ships (it changes a little between Python versions).
"""
CALIBRATION_TOPICS = ("objects", "naming")
EVALUATION_TOPICS = ("execmodel", "import", "customization")


def english_text(topic: str) -> str:
    from pydoc_data.topics import topics  # 0.5 MB of text: loaded only when asked for
    return topics[topic]
