"""Wire layer: the protobuf codec (:mod:`.codec`) and the gRPC policy-worker service (:mod:`.grpc_server`,
:mod:`.grpc_client`). Import the gRPC modules explicitly; this package imports nothing heavy by itself."""
