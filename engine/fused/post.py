"""The `post` buffer of a fused decode call: what the call and the store's driver tell each other while it runs.

One int64 array per plan (engine/fused/plan.py allocates it): the kernel (engine/fused/kernel.py) writes
thread 0's words, the read-ahead's guesses and the experts a layer waits for; the driver thread
(engine/fused/driver.py) reads those and writes back where it cannot bring them. `PostLayout` names each
region's offset; the kernel, which cannot take a dataclass, finds the same offsets in its globals `g`
(the G_P_* entries, written by the plan from this layout).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_GUESS = 64      # expert ids an id row holds: the most the read-ahead may guess (the kernel's integer scratch)
W_ALL, W_STOP, W_SOME = 1, 2, 3   # thread 0's words on a streamed layer's experts (the `word` region)


@dataclass(frozen=True)
class PostLayout:
    """Where each region of a `post` buffer of a model with `layers` layers begins (offsets in int64 words).

    Per layer l, at region + l:
      word      thread 0's word on layer l's streamed experts: 0 not decided yet, W_ALL all in memory (every thread
                runs them), W_STOP not (the call stops there), W_SOME some (every thread runs the slots in `mask`
                while the others are read, then `second` says W_ALL, they came, or W_STOP)
      guessed   how many experts the read-ahead guessed for layer l (their ids at `guess_ids(l)`)
      needed    how many experts layer l needs that were not all in memory (their ids at `need_ids(l)`): the call
                waits for them
      refused   1 when the driver cannot bring layer l's needs (the call stops there)
      mask      with W_SOME, the slots of layer l whose experts were in memory (bit k: slot k)
      second    thread 0's second word on layer l after W_SOME
    Single words and rows:
      deciding  the layer thread 0 decides now (the driver takes memory only from experts of earlier layers)
      ids       2L rows of MAX_GUESS expert ids: the guesses for layer l at row l, its needs at row L + l
    """

    layers: int

    @property
    def word(self) -> int:
        """Start of thread 0's words [L]."""
        return 0

    @property
    def guessed(self) -> int:
        """Start of the guess counts [L]."""
        return self.layers

    @property
    def needed(self) -> int:
        """Start of the need counts [L]."""
        return 2 * self.layers

    @property
    def refused(self) -> int:
        """Start of the driver's refusals [L]."""
        return 3 * self.layers

    @property
    def deciding(self) -> int:
        """The word holding the layer thread 0 decides now [1]."""
        return 4 * self.layers

    @property
    def ids(self) -> int:
        """Start of the id rows [2L, MAX_GUESS]."""
        return 4 * self.layers + 1

    @property
    def mask(self) -> int:
        """Start of the present-slot masks [L]."""
        return self.ids + 2 * self.layers * MAX_GUESS

    @property
    def second(self) -> int:
        """Start of thread 0's second words [L]."""
        return self.mask + self.layers

    @property
    def size(self) -> int:
        """The buffer's length in int64 words."""
        return self.second + self.layers

    def id_row(self, row: int) -> int:
        """Where id row `row` begins (guesses for layer l at row l, needs at row L + l)."""
        return self.ids + row * MAX_GUESS

    def guess_ids(self, layer: int) -> int:
        """Where the read-ahead's guessed expert ids for `layer` begin."""
        return self.id_row(layer)

    def need_ids(self, layer: int) -> int:
        """Where the expert ids `layer` waits for begin."""
        return self.id_row(self.layers + layer)

    def regions(self) -> dict[str, range]:
        """Every region by name, as the range of words it spans (in order, together the whole buffer)."""
        n = self.layers
        return {
            "word": range(self.word, self.word + n),
            "guessed": range(self.guessed, self.guessed + n),
            "needed": range(self.needed, self.needed + n),
            "refused": range(self.refused, self.refused + n),
            "deciding": range(self.deciding, self.deciding + 1),
            "ids": range(self.ids, self.ids + 2 * n * MAX_GUESS),
            "mask": range(self.mask, self.mask + n),
            "second": range(self.second, self.second + n),
        }
