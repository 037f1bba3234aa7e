"""The router in front of N inference servers: the aiohttp app, its view of the backends, and the runs that
share one fleet."""
