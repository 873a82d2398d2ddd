#!/usr/bin/env python3
"""A c10d TCPStore for the c10d_store tests (tests/store/store_test.cpp).

  c10d_server.py torch    torch.distributed.TCPStore itself (the Python that
                          runs this must have torch: Debian's python3-torch)
  c10d_server.py torch2   torch 2.x's protocol, served here: validate first,
                          then torch 2's query codes. Debian 12 ships torch
                          1.13, so this is how the torch 2 dialect is tested;
                          it follows TCPStoreBackend.cpp's rules (a first
                          query other than validate, or one it cannot carry
                          out, closes the connection).

Prints "port N" once listening on 127.0.0.1; then reads commands from
stdin, one per line, answering each with a line: "set KEY VALUE" (prints
"ok"), "get KEY" (prints the value, waiting for it), "keys" (prints the
number of keys). KEY is what a TCPStore client of Python sees (on the wire,
after a "/"). Exits when stdin ends.
"""
import asyncio
import struct
import sys
import threading


def serve_torch():
    import datetime
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                     wait_for_workers=False)
    print(f"port {store.port}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["set"]:
            store.set(words[1], words[2])
            print("ok", flush=True)
        elif words[:1] == ["get"]:
            print(store.get(words[1]).decode(), flush=True)
        elif words[:1] == ["keys"]:
            print(store.num_keys(), flush=True)


# torch 2.x's query codes (TCPStoreBackend.hpp).
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY = range(9)
CANCEL_WAIT = 12
MAGIC = 0x3C85F7CE


class Torch2Store:
    def __init__(self):
        self.data = {}
        self.waiting = []  # [keys still missing, writer]

    def wake(self, key):
        for w in self.waiting:
            w[0].discard(key)
            if not w[0]:
                w[1].write(b"\0")
        self.waiting = [w for w in self.waiting if w[0]]

    async def client(self, reader, writer):
        async def u64():
            return struct.unpack("<Q", await reader.readexactly(8))[0]

        async def string():
            return await reader.readexactly(await u64())

        def send_value(v):
            writer.write(struct.pack("<Q", len(v)) + v)

        try:
            first = True
            while True:
                q = (await reader.readexactly(1))[0]
                if first:
                    first = False
                    if q != VALIDATE or struct.unpack("<I", await reader.readexactly(4))[0] != MAGIC:
                        break
                    continue
                if q == SET:
                    k, v = await string(), await string()
                    self.data[k] = v
                    self.wake(k)
                elif q == COMPARE_SET:
                    k, expected, desired = await string(), await string(), await string()
                    if k not in self.data:
                        if expected:
                            send_value(expected)
                        else:
                            self.data[k] = desired
                            send_value(desired)
                            self.wake(k)
                    else:
                        if self.data[k] == expected:
                            self.data[k] = desired
                        send_value(self.data[k])
                elif q == GET:
                    send_value(self.data[await string()])
                elif q == ADD:
                    k, delta = await string(), struct.unpack("<q", await reader.readexactly(8))[0]
                    value = int(self.data.get(k, b"0")) + delta
                    value = (value + 2**63) % 2**64 - 2**63
                    self.data[k] = str(value).encode()
                    writer.write(struct.pack("<q", value))
                    self.wake(k)
                elif q in (CHECK, WAIT):
                    keys = [await string() for _ in range(await u64())]
                    missing = {k for k in keys if k not in self.data}
                    if q == CHECK:
                        writer.write(b"\0" if not missing else b"\1")
                    elif not missing:
                        writer.write(b"\0")
                    else:
                        self.waiting.append([missing, writer])
                elif q == GETNUMKEYS:
                    writer.write(struct.pack("<q", len(self.data)))
                elif q == DELETE_KEY:
                    writer.write(struct.pack("<q", 1 if self.data.pop(await string(), None) is not None else 0))
                elif q == CANCEL_WAIT:
                    self.waiting = [w for w in self.waiting if w[1] is not writer]
                    writer.write(b"\1")
                else:
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, KeyError, ValueError):
            pass
        self.waiting = [w for w in self.waiting if w[1] is not writer]
        writer.close()


def serve_torch2():
    store = Torch2Store()
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(store.client, "127.0.0.1", 0))
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)

    def on_loop(f):
        return asyncio.run_coroutine_threadsafe(f(), loop).result()

    def commands():
        for line in sys.stdin:
            words = line.split()
            if len(words) > 1:
                words[1] = "/" + words[1]  # as torch's TCPStore client sends keys
            if words[:1] == ["set"]:
                async def do_set():
                    store.data[words[1].encode()] = words[2].encode()
                    store.wake(words[1].encode())
                on_loop(do_set)
                print("ok", flush=True)
            elif words[:1] == ["get"]:
                async def do_get():
                    while words[1].encode() not in store.data:
                        await asyncio.sleep(0.01)
                    return store.data[words[1].encode()]
                print(on_loop(do_get).decode(), flush=True)
            elif words[:1] == ["keys"]:
                async def count():
                    return len(store.data)
                print(on_loop(count), flush=True)
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=commands, daemon=True).start()
    loop.run_forever()


if __name__ == "__main__":
    {"torch": serve_torch, "torch2": serve_torch2}[sys.argv[1]]()
