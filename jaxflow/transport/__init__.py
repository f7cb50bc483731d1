"""Getting the services to other processes: wire.py (msgpack frames with raw tensor bytes, never pickle),
rpc.py (serve any object's allow-listed methods on loopback, within limits), client.py (its client),
errors.py (exceptions across the wire), process_server.py (serve from a child process), param_client.py
(a parameter service's client: shared memory or chunked streaming). The services never import this
package; it registers their types and errors."""
