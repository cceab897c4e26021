#!/usr/bin/env python3
"""Module import circles inside each library crate: prints every cycle between sibling modules
(a -> b -> a through `crate::`/`super::` paths outside comments and test modules, inline or\nin files of their own) and exits 1
if there is one. Usage: scripts/module-cycles.py kvfabric tiers serving router"""
import os,re,sys
def mods(root):
    out={}
    for dp,_,fs in os.walk(root):
        for f in fs:
            if not f.endswith('.rs'): continue
            p=os.path.join(dp,f); rel=os.path.relpath(p,root)[:-3].split('/')
            if rel[-1] in('mod','lib'): rel=rel[:-1]
            if rel and rel[-1]=='main': continue
            out[tuple(rel)]=open(p).read()
    return out
def analyse(crate):
    ms=mods(crate+'/src')
    # Test-only modules in files of their own (`#[cfg(test)] mod x;`) are left out, as inline
    # test modules are.
    for m,src in list(ms.items()):
        for t in re.findall(r"#\[cfg\(test\)\]\s*mod (\w+);",src):
            ms.pop(m+(t,),None)
    names=set(ms)
    edges={m:set() for m in ms}
    for m,src in ms.items():
        src="\n".join(l for l in src.split("\n") if not l.strip().startswith("//"))
        src=re.sub(r"#\[cfg\(test\)\]\s*mod \w+\s*\{.*","",src,flags=re.S)
        # expand grouped uses: use crate::{a, b::c}
        for g in re.finditer(r'(crate|super)::\{([^}]*)\}',src):
            for item in g.group(2).split(','):
                item=item.strip().split(' ')[0]
                src+=f"\n{g.group(1)}::{item};"
        for r in re.finditer(r'\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)',src):
            parts=r.group(2).split('::')[1:]
            base=() if r.group(1)=='crate' else m[:-1]
            path=base+tuple(parts)
            # longest module prefix
            best=None
            for k in range(len(path),0,-1):
                if path[:k] in names: best=path[:k]; break
            if best is None or best==m: continue
            # ignore edges to ancestors/descendants (module tree)
            if m[:len(best)]==best or best[:len(m)]==m: continue
            # collapse to siblings: find common prefix, compare children at divergence
            i=0
            while i<min(len(m),len(best)) and m[i]==best[i]: i+=1
            a=m[:i+1]; b=best[:i+1]
            if a!=b: edges.setdefault(a,set()).add(b)
    # find cycles (SCC)
    idx={};low={};st=[];on=set();res=[];c=[0]
    def sc(v):
        idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
        for w in edges.get(v,()):
            if w not in idx: sc(w);low[v]=min(low[v],low[w])
            elif w in on: low[v]=min(low[v],idx[w])
        if low[v]==idx[v]:
            comp=[]
            while True:
                w=st.pop();on.discard(w);comp.append(w)
                if w==v: break
            if len(comp)>1: res.append(comp)
    for v in list(edges):
        if v not in idx: sc(v)
    for comp in res:
        found.append(comp)
        print(crate, 'cycle:', sorted('::'.join(x) for x in comp))
        for a in comp:
            for b in edges.get(a,()):
                if b in comp: print('   ', '::'.join(a),'->','::'.join(b))
found=[]
for c in sys.argv[1:]: analyse(c)
sys.exit(1 if found else 0)
