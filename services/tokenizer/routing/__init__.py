"""Which scheduler serves a request: the router policies, the pool of scheduler connections and the
scheduler requests the gateway tracks."""
