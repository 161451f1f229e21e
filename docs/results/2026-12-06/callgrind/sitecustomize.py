import ctypes
import signal

_lib = ctypes.CDLL("/tmp/cg/libcgctl.so")
_name = [b"idle"]


def _on(sig, frame):
    _lib.cg_start()


def _off(sig, frame):
    _lib.cg_stop(ctypes.c_char_p(_name[0]))
    _name[0] = b"busy"


signal.signal(signal.SIGUSR1, _on)
signal.signal(signal.SIGUSR2, _off)
