"""What travels on the wire: payloads and their exact byte counts, bit packing, the control rows
that ride inside collectives, and the ledger of bytes sent."""
