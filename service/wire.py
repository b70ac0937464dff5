"""Facts about the wire format shared by the server and the client, read off the generated descriptors."""

from service.api.ovserve.v1 import ovserve_pb2 as pb

_NOT_OPTIONS = ("request_id", "prompt")

# GenerateRequest's proto3 `optional` scalar fields that map one to one onto SamplingParams; unset ones keep
# the server's defaults.
SAMPLING_FIELDS = tuple(
    f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.has_presence and f.name not in _NOT_OPTIONS
)
