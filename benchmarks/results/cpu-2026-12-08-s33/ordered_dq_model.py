"""Discrete-event model of the ordered (deterministic) dQ under causal: CTAs per (head, key block),
132 slots, each step = 1 unit of compute, a 1-deep dQ staging buffer per CTA, adds into a query block
in a fixed key-block order (ascending: 0..N_m; descending: N_m..0)."""
import heapq, sys

def simulate(NB, H, slots, order, launch, add=0.05, det=True):
    # per head: CTA n visits query blocks n..NB-1
    ctas = []
    for h in range(H):
        ns = range(NB) if launch == "asc" else range(NB - 1, -1, -1)
        ctas += [(h, n) for n in ns]
    # added[h][m] = number of adds done into block m ; turn of (n) at block m
    added = [[0] * NB for _ in range(H)]
    done_add_time = {}  # (h, m, turn) -> time the add with that turn finished
    # event simulation: process CTAs step by step with global time; simple approach: iterate until all done,
    # each CTA is a state machine; use a priority queue of (time, cta_id) to advance
    state = {}
    free = slots
    t = 0.0
    queue = list(ctas)
    running = []  # heap of (time_ready, idx)
    pending = []  # CTAs waiting on a turn: (idx)
    import collections
    waiting = collections.defaultdict(list)  # (h, m, turn) -> [idx]
    info = {}
    def turn_of(n, m):
        # key blocks that see block m: 0..m (causal, Sq == Sk, BLOCK_M == BLOCK_N)
        return n if order == "asc" else m - n
    def start(i, now):
        h, n = ctas[i]
        info[i] = {"step": 0, "compute_done": None, "add_done": [now] * 2, "steps": NB - n}
        heapq.heappush(running, (now + 1.0, i, "compute"))
    nxt = 0
    finished = 0
    ends = []
    while nxt < len(ctas) and free > 0:
        start(nxt, 0.0); nxt += 1; free -= 1
    while running:
        now, i, kind = heapq.heappop(running)
        h, n = ctas[i]
        st = info[i]
        if kind == "compute":
            s = st["step"]; m = n + s
            st["compute_done"] = now
            # the add of step s: needs the previous add done and its turn
            def try_add(at, i=i, s=s, m=m):
                tr = turn_of(n, m)
                if det and added[h][m] != tr:
                    waiting[(h, m, tr)].append((i, s))
                    return
                heapq.heappush(running, (max(at, st["add_done"][-1]) + add, i, "add"))
            st["pending_add"] = (s, m)
            try_add(now)
        elif kind == "add":
            s, m = st["pending_add"]
            added[h][m] += 1
            st["add_done"].append(now)
            # wake a waiter of the next turn
            for (j, sj) in waiting.pop((h, m, added[h][m]), []):
                stj = info[j]
                heapq.heappush(running, (max(now, stj["add_done"][-1]) + add, j, "add"))
            st["step"] += 1
            if st["step"] == st["steps"]:
                ends.append(now); free += 1
                if nxt < len(ctas):
                    start(nxt, now); nxt += 1; free -= 1
                continue
            # next compute: after this add (1-deep staging: the next step's dQ store needs it free) -- the compute
            # itself could overlap the add, so start it at the previous compute's end, but its add waits
            heapq.heappush(running, (max(st["compute_done"], now - add) + 1.0, i, "compute"))
    return max(ends)

NB, H, SL = 128, 16, 132
base = simulate(NB, H, SL, "asc", "asc", det=False)
for order, launch in (("asc", "asc"), ("desc", "desc"), ("desc", "asc")):
    try:
        t = simulate(NB, H, SL, order, launch)
        print(order, launch, round(t / base, 3))
    except Exception as e:
        print(order, launch, "ERR", e)
print("nondet heavy-first", base, "light-first", simulate(NB, H, SL, "asc", "desc", det=False) / base)
