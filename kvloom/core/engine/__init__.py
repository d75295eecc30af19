"""The engine side of the step boundary: the plain values the scheduler and the model runner exchange,
and the coordination of speculative decoding."""
