"""Argument checks shared by the public entry points; messages name the offending value."""


def positive_int(name: str, value) -> None:
    """A size argument of the core API: TypeError when not an int (a bool is not one), ValueError when <= 0."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def positive_ints(**values) -> None:
    """Raise ValueError naming the first of ``values`` that is not a positive int (a bool is not one)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
