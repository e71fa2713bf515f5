"""An abstract model of linear_wgmma_cvt_kernel's mbarrier protocol (kernels/linear_wgmma_cvt.cuh): the producer
(TMA of W and X, or TMA of W and the gathered X rows by cp.async with `lag` stages in flight), the TMA engine, the
converter and the consumers, each barrier a phase counter with its arrival count and transaction bytes, run
under random interleavings. It checks that every schedule completes: S stages, SA A stages, nk k-tiles a tile.
  python3 benchmarks/cvt_ring_model.py
Found: with S = 4 a gather lag of 3 (the RS kernel's) deadlocks, 2 does not (S >= lag + 2)."""
import random

def run(S, SA, lag, gather, nk_per_tile, tiles, seed):
    rng = random.Random(seed)
    # barrier state: completed phases count; arrivals in current phase
    class Bar:
        def __init__(s, count): s.count=count; s.arr=0; s.done=0; s.tx=0
        def arrive(s, tx=0):
            s.arr += 1
            if s.arr == s.count and s.tx == 0: s.arr=0; s.done+=1
        def complete_tx(s):
            s.tx -= 1
            if s.arr == s.count and s.tx == 0: s.arr=0; s.done+=1
        def expect(s): s.tx += 1; s.arrive()  # arrive.expect_tx (counts as the arrival)
    full=[Bar(128 if gather else 1) for _ in range(S)]; wfull=[Bar(1) for _ in range(S)]
    empty=[Bar(8+4) for _ in range(S)]; afull=[Bar(1) for _ in range(SA)]; aempty=[Bar(8) for _ in range(SA)]
    # waiting for phase parity p of barrier b means: wait until b.done > k where k = number of completions needed
    total = nk_per_tile*tiles
    inflight=[]  # tma completions pending (completed by the 'tma' role)
    def tma():
        while True:
            if inflight:
                k,ss=inflight.pop(0); (wfull if k=='w' else full)[ss].complete_tx()
            yield
    def producer():
        pending=[]  # stages whose copies are in flight (gather)
        for i in range(total):
            s=i%S; need=i//S  # empty completions needed: i//S (first round passes)
            while empty[s].done < need: yield
            wfull[s].expect(); inflight.append(('w',s))
            if not gather:
                full[s].expect(); inflight.append(('x',s))
            else:
                pending.append(s)
                if len(pending) > lag:
                    s0=pending.pop(0)
                    for _ in range(128): full[s0].arrive()
            yield
        for s0 in pending:
            for _ in range(128): full[s0].arrive()
        yield 'done'
    def converter():
        for i in range(total):
            s=i%S; sa=i%SA
            while wfull[s].done < i//S+1: yield
            while aempty[sa].done < i//SA: yield
            yield
            afull[sa].arrive()
            for _ in range(4): empty[s].arrive()
        yield 'done'
    def consumers():
        prev=None
        for i in range(total):
            s=i%S; sa=i%SA
            while full[s].done < i//S+1: yield
            while afull[sa].done < i//SA+1: yield
            yield
            if i % nk_per_tile != 0 and prev is not None:
                ps,psa=prev
                for _ in range(8): empty[ps].arrive()
                for _ in range(8): aempty[psa].arrive()
            prev=(s,sa)
            if i % nk_per_tile == nk_per_tile-1:
                ps,psa=prev
                for _ in range(8): empty[ps].arrive()
                for _ in range(8): aempty[psa].arrive()
                prev=None
        yield 'done'
    roles={'p':producer(),'c':converter(),'k':consumers(),'t':tma()}
    done=set(); stuck=0; progress=0
    while len(done)<3:
        name=rng.choice([r for r in roles if r not in done])
        st=(empty[0].done,full[0].done,afull[0].done,aempty[0].done,wfull[0].done)
        r=next(roles[name])
        if r=='done': done.add(name)
        st2=(empty[0].done,full[0].done,afull[0].done,aempty[0].done,wfull[0].done)
        progress+=1
        if progress>200000: return False
    return True

for gather,lag in [(False,0),(True,2),(True,3)]:
    ok=all(run(4,3,lag,gather,8,5,seed) for seed in range(20))
    print("gather" if gather else "dense", "lag", lag, "completes" if ok else "DEADLOCK (no completion)")
