"""An outer optimizer over the averages a protocol makes: DiLoCo's outer step (Douillard et
al., 2023) for ``persyn``, so periodic averaging over gossip can be DiLoCo over gossipd's
own transport.

After each burst of averaging the node holds about the mesh's average x̄ of what every site
trained since the last outer step. The pseudo-gradient is the shared model before those
steps minus that average (what the sites' inner steps moved it, as a gradient points);
the outer step is SGD with Nesterov momentum on it (torch's formula: b ← μ·b + g, then
θ ← θ − lr·(g + μ·b)), and the node trains on from the new θ. With a learning rate of 1
and no momentum θ is the average itself: plain periodic averaging.

The arithmetic is written on whatever arrays it is given (torch tensors in the daemon,
numpy vectors in the simulator), so both run this one class. The first outer step only
records θ: sites need not start from one model, and a pseudo-gradient from one site's
own initial model would pull every other site towards it.
"""

from __future__ import annotations

from typing import Any


class OuterNesterov:
    """Per segment: the shared model θ and its momentum buffer."""

    def __init__(self, learning_rate: float, momentum: float) -> None:
        if learning_rate <= 0 or not 0 <= momentum < 1:
            raise ValueError(
                f"outer learning rate {learning_rate} must be over 0 and momentum "
                f"{momentum} in [0, 1)"
            )
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.shared: dict[int, Any] = {}
        self._buffers: dict[int, Any] = {}
        self.steps = 0  # outer steps taken (the recording one not counted)

    def step(self, segment: int, averaged: Any) -> Any:
        """The new shared values of ``segment`` given the average the burst made (a new
        array; the caller loads it into the model)."""
        shared = self.shared.get(segment)
        if shared is None:
            self.shared[segment] = averaged * 1.0  # a copy: the model trains on in place
            return self.shared[segment]
        grad = shared - averaged
        update = grad
        if self.momentum:
            buffer = self._buffers.get(segment)
            buffer = grad * 1.0 if buffer is None else buffer * self.momentum + grad
            self._buffers[segment] = buffer
            update = grad + buffer * self.momentum
        self.shared[segment] = shared - update * self.learning_rate
        if segment == 0:  # the drivers step every segment in order, one step of the model
            self.steps += 1
        return self.shared[segment]

    @property
    def nbytes(self) -> int:
        """Memory held: the shared model and the momentum buffers."""
        arrays = [*self.shared.values(), *self._buffers.values()]
        return sum(int(a.nbytes) for a in arrays)
