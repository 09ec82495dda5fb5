"""How many tensors a lazy mapping has handed out that are still alive, at most, while loading."""
import torch


def most_alive(monkeypatch, mapping_class) -> list[int]:
    """Patch ``mapping_class.__getitem__`` to count the tensors it returned that are not yet freed;
    the returned one-element list holds the most seen at once (each lookup included)."""
    read, alive, most = mapping_class.__getitem__, torch.utils.weak.WeakTensorKeyDictionary(), [0]

    def counted(self, name):
        t = read(self, name)
        alive[t] = None
        most[0] = max(most[0], len(alive))
        return t

    monkeypatch.setattr(mapping_class, "__getitem__", counted)
    return most
