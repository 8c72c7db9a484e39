"""Multi-turn rollouts as the rows `LMObjective` scores: `Turn`, `pack`, `PackedSessions`.

A session is one rollout's turns in order: a prompt, the policy's sampled answer, what the
environment (a user, a tool) said back, the next sampled answer, and so on, each already token ids.
`pack` lays each session into one row of `seq_len + 1` tokens with a `Role` per token, and records
for every sampled token the sampler's likelihood and the ids the sampler kept for it (its support,
e.g. the top-k a filter left), which `LMObjective.sampled_log_probs` renormalises over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dew.data.chat import Role


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn of a session: its token ids and whose they are (`Role`, or its name). A turn the
    policy sampled gives `log_probs`, each token's likelihood as the sampler saw it, and may give
    `support`, each token's kept ids (the token among them); without `support` the sampler kept
    every id, and the target is scored over the whole vocabulary. A turn without `log_probs` was not
    sampled (a prompt, an environment's answer)."""

    role: Role | str
    tokens: Sequence[int]
    log_probs: Sequence[float] | None = None
    support: Sequence[Sequence[int]] | None = None


@dataclasses.dataclass(frozen=True)
class PackedSessions:
    """Sessions one to a row: `tokens`, `roles` (`Role.NONE` for padding), `segment_ids` (1 for the
    session, 0 for padding), int32 `[B, seq_len + 1]`; per target `[B, seq_len]`, whether the policy
    sampled it (`sampled`) and the sampler's likelihood of it (`log_probs`, 0 where not sampled); and
    `support`, the ragged `(ids, columns)` pair, int32 `[B, C]` each: entry `c` of row `b` keeps id
    `ids[b, c]` for the target in column `columns[b, c]` of `tokens`, -1 marking unused entries."""

    tokens: np.ndarray
    roles: np.ndarray
    segment_ids: np.ndarray
    sampled: np.ndarray
    log_probs: np.ndarray
    support: tuple[np.ndarray, np.ndarray]

    def batch(self) -> dict[str, np.ndarray]:
        """The rows as an `LMObjective` batch: text, text_segment_ids, text_positions, text_roles."""
        positions = np.where(self.segment_ids > 0, np.arange(self.tokens.shape[1])[None, :], 0).astype(np.int32)
        return {"text": self.tokens, "text_segment_ids": self.segment_ids, "text_positions": positions,
                "text_roles": self.roles}


def pack(sessions: Sequence[Sequence[Turn]], seq_len: int, pad_id: int = 0) -> PackedSessions:
    """Each session's turns, in order, as one row of `seq_len + 1` tokens (see `PackedSessions`).

    A session longer than a row is refused, as is a sampled turn that opens a session (its first
    token has no context to be predicted from), sampled likelihoods or supports that are not one per
    token, and a sampled token missing from its own support.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len is {seq_len}: a row needs at least 1 input token")
    width, rows = seq_len + 1, len(sessions)
    if rows == 0:
        raise ValueError("no sessions were given: pass a list of sessions, each a list of Turns")
    tokens = np.full((rows, width), pad_id, np.int32)
    roles = np.zeros((rows, width), np.int32)
    segment_ids = np.zeros((rows, width), np.int32)
    sampled = np.zeros((rows, seq_len), bool)
    log_probs = np.zeros((rows, seq_len), np.float32)
    entries: list[list[tuple[int, int]]] = []  # each row's (id, column) support entries
    for row, session in enumerate(sessions):
        cursor, kept = 0, []
        for index, turn in enumerate(session):
            where = f"session {row}, turn {index}"
            ids = [int(token) for token in turn.tokens]
            role = Role.of(turn.role, f"{where}: role")
            end = cursor + len(ids)
            if end > width:
                total = sum(len(t.tokens) for t in session)
                raise ValueError(f"session {row} is {total} tokens, longer than a row of seq_len + 1 = {width}: use a "
                                 "larger seq_len, or end the rollout sooner")
            tokens[row, cursor:end], roles[row, cursor:end], segment_ids[row, cursor:end] = ids, int(role), 1
            if turn.log_probs is not None:
                kept += _sampled(turn, ids, cursor, where)
                sampled[row, cursor - 1:end - 1] = True
                log_probs[row, cursor - 1:end - 1] = np.asarray(turn.log_probs, np.float32)
            elif turn.support is not None:
                raise ValueError(f"{where} gives a support and no log_probs: a sampled turn records both")
            cursor = end
        entries.append(kept)
    count = max(1, max(len(kept) for kept in entries))
    support_ids = np.zeros((rows, count), np.int32)
    columns = np.full((rows, count), -1, np.int32)
    for row, kept in enumerate(entries):
        if kept:
            support_ids[row, :len(kept)], columns[row, :len(kept)] = zip(*kept)
    return PackedSessions(tokens, roles, segment_ids, sampled, log_probs, (support_ids, columns))


def _sampled(turn: Turn, ids: list[int], cursor: int, where: str) -> list[tuple[int, int]]:
    """A sampled turn's (id, column) support entries, its shape checked against its tokens."""
    if cursor == 0:
        raise ValueError(f"{where} is sampled and opens the session: its first token has no context to be predicted "
                         "from; put the prompt before it")
    if len(turn.log_probs) != len(ids):
        raise ValueError(f"{where} has {len(ids)} tokens and {len(turn.log_probs)} log_probs: give one per token")
    if turn.support is None:
        return []
    if len(turn.support) != len(ids):
        raise ValueError(f"{where} has {len(ids)} tokens and {len(turn.support)} supports: give each token its kept ids")
    entries = []
    for offset, (token, kept) in enumerate(zip(ids, turn.support)):
        kept = [int(i) for i in kept]
        if token not in kept:
            raise ValueError(f"{where}, token {offset} ({token}) is not among its {len(kept)} kept ids: the sampler "
                             "could not have drawn it")
        entries += [(i, cursor + offset) for i in kept]
    return entries
