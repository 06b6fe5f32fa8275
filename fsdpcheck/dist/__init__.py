"""Talking to the other ranks: the transport, and the one way a call's steps agree.

- ``comm``: ``Comm``, the process group fsdpcheck talks over. Every wait has a deadline (the
  group's timeout, or ``timeout=``), and a rank that stops answering (dead, stopped, or stuck
  elsewhere) is named by the others in one line (NOTE: [a rank that stops answering]).
- ``runner``: ``call``, one entry point's run on this rank, and its steps. A local step that
  fails is data until the next agreement, which every rank makes: one failure
  (``RankFailure``) then ends the call identically on every rank; the call's arguments are
  agreed by digest in its first agreement; a second thread on the same group is refused
  (NOTE: [one step runner]).
- ``arguments``: how arguments become digests that mean the same on every rank.

``fsdpcheck.collectives`` holds the combining arithmetic these carry (digests, ``distinct``,
the statistics); ``fsdpcheck.offline_dist`` the passes of a torchrun launch, built on the same
runner.
"""
