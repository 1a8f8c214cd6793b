"""`colibri moefy`: a dense model upcycled into a Mixtral-architecture MoE."""
