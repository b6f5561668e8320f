"""`launch.free_port`: the port Ray Serve's proxy binds, chosen where none of Ray's own processes can take it."""
import socket

import pytest

from specserve.errors import SpecServeError
from specserve.scaleout.launch import _ephemeral_start, free_port


def test_a_port_for_0_is_free_and_outside_rays_and_the_kernels_ranges():
    for _ in range(20):
        port = free_port("127.0.0.1", 0)
        assert 20000 <= port < _ephemeral_start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_a_taken_port_is_a_clear_error_and_a_free_one_is_kept():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(SpecServeError, match=f"cannot listen on 127.0.0.1:{taken}"):
            free_port("127.0.0.1", taken)
    assert free_port("127.0.0.1", taken) == taken  # closed again
