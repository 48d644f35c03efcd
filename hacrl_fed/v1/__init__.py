"""Generated protobuf / gRPC modules of the ``hacrl_fed.v1`` wire schema (``proto/hacrl_fed/v1/worker.proto``).

Do not edit ``worker_pb2*.py`` by hand: run ``scripts/gen_proto.sh`` (``--check`` fails on drift). Convert to and
from the dataclasses of :mod:`hacrl_fed.types` only through :mod:`hacrl_fed.wire.codec`.
"""
