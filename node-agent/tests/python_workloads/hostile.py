import ctypes, os, sys

# A process corrupting its own frame chain, as a hostile pod may: `loop` points the
# running function's frame back at itself (a chain without end), `garbage` points its
# caller's at random bytes (a frame whose code object and next frame are noise).
# argv: mode, offset of a frame's previous-frame pointer (bpf/python.h frame_previous).

mode, previous = sys.argv[1], int(sys.argv[2])
noise = os.urandom(4096)

def frame_address(f):
    if sys.version_info >= (3, 11):
        # PyFrameObject { PyObject_HEAD; f_back; f_frame; ... }: the interpreter frame.
        return ctypes.c_void_p.from_address(id(f) + 24).value
    return id(f)

def spin():
    me = frame_address(sys._getframe())
    if mode == "loop":
        ctypes.c_void_p.from_address(me + previous).value = me
    else:
        caller = frame_address(sys._getframe(1))
        # Inside the bytes object's data: readable, and nothing but noise.
        ctypes.c_void_p.from_address(caller + previous).value = id(noise) + 64
    print("ready", flush=True)
    # Small ints only: nothing is allocated, so nothing (the collector) walks the frames.
    x = 0
    while True:
        x ^= 1

def main():
    spin()

main()
