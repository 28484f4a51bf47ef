"""The decode loops (one row, a batch, recurrent state) and the phases of a step they share: the call
context, the tree forward and its cost, acceptance, the static cache, statistics and host-wait counting."""
