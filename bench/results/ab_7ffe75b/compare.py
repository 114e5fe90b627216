import json, os, statistics as st, collections
HERE = os.path.dirname(os.path.abspath(__file__))
def rows(path):
    d=json.load(open(path)); return d["rows"]
def key(r, bench):
    if bench=="allreduce": return (r["impl"], r["P"], r["size"])
    return (r.get("impl"), r.get("P"))
def val(r, bench):
    if bench=="allreduce": return r["time_us_median"]
    for k in ("latency_us_mean","mean_latency_us","latency_mean_us","time_us_mean"):
        if k in r: return r[k]
    return None
for bench in ("allreduce","skew"):
    ratios=collections.defaultdict(list); base_v=collections.defaultdict(list); new_v=collections.defaultdict(list)
    for i in (1,2,3):
        try: b=rows(f"{HERE}/base_{bench}_{i}.json"); n=rows(f"{HERE}/new_{bench}_{i}.json")
        except FileNotFoundError: continue
        bm={key(r,bench):val(r,bench) for r in b}; nm={key(r,bench):val(r,bench) for r in n}
        for k in bm:
            if k in nm and bm[k] and nm[k]:
                ratios[k].append(nm[k]/bm[k]); base_v[k].append(bm[k]); new_v[k].append(nm[k])
    print(f"== {bench}: new/base time ratio per pair (median [min-max]), base and new medians")
    for k in sorted(ratios, key=str):
        r=ratios[k]; print(f"{str(k):45s} {st.median(r):.2f} [{min(r):.2f}-{max(r):.2f}] n={len(r)}  base {st.median(base_v[k]):.1f}  new {st.median(new_v[k]):.1f}")
