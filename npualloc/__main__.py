"""Command line: ``python -m npualloc demo``."""
import argparse
import sys


def demo(args):
    """A short tour of the virtual NPU runtime."""
    from . import acl

    count, _ = acl.rt.get_device_count()
    print(f"virtual NPU server: {count} devices")
    acl.rt.set_device(0)
    ptr, ret = acl.rt.malloc(64 << 20, 0)
    print(f"acl.rt.malloc(64 MiB) -> {ptr:#x}, ret={ret}")
    print(f"acl.rt.free -> ret={acl.rt.free(ptr)}")
    ret = acl.rt.free(ptr)
    print(f"acl.rt.free again -> ret={ret} (ACL_ERROR_RT_MEMORY_FREE)")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m npualloc")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo").set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
