"""The one error type of the quantization pipeline."""


class QuantizeError(ValueError):
    """A quantization run cannot proceed: bad source, bad option, bad calibration data, NaN weights, ..."""
