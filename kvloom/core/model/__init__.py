"""The model room: layers that own their weights (``linear``) and the quantization methods that make them
(``quantization``)."""
