#!/usr/bin/env python3
"""No module circles (issue 42): scripts/check-module-circles.py [--fold] prints, per crate, its
modules, the import edges between them and the circles (strongly connected components), and
exits 1 if there is any. A child using its parent (`use super::*`) is not a circle.

Module import graph per crate from `use crate::`/`crate::` paths and `super::` in child modules.
Nodes: top-level modules of the crate (children folded into their top-level parent, except
that edges between a parent and its own children are kept separately as nodes 'a::b')."""
import re,os,sys,itertools
root=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
crates={'hotrestart':'hotrestart/src','proxy':'proxy/src','agent':'agent/src','drain':'drain/src'}
def strip_tests(text):
    # drop #[cfg(test)] mod tests { ... } blocks at any indent
    out=[];lines=text.split('\n');i=0
    while i<len(lines):
        l=lines[i]
        if l.strip()=='#[cfg(test)]' and i+1<len(lines) and re.match(r'^\s*(pub(\(crate\))?\s+)?mod \w+\s*(\{|;)',lines[i+1]):
            m=re.match(r'^(\s*)',lines[i+1]);ind=m.group(1)
            if lines[i+1].rstrip().endswith(';'): i+=2; continue
            j=i+2
            while j<len(lines) and lines[j]!=ind+'}': j+=1
            i=j+1; continue
        out.append(l); i+=1
    return '\n'.join(out)
def strip_comments(t):
    return '\n'.join(re.sub(r'//.*','',l) for l in t.split('\n'))
fold = '--fold' in sys.argv
found = 0
for crate,src in crates.items():
    base=os.path.join(root,src)
    mods={}
    for dp,dn,fn in os.walk(base):
        for f in fn:
            if not f.endswith('.rs'): continue
            rel=os.path.relpath(os.path.join(dp,f),base)[:-3]
            if rel in('lib','main'): name='crate'
            else: name=rel.replace('/','::')
            if name.split('::')[-1] in ('tests','testing') : continue
            mods[name]=strip_comments(strip_tests(open(os.path.join(dp,f)).read()))
    tops=set(mods)
    # names the crate root re-exports (`pub use m::{A, B}` / `pub use m::A`): crate::A is m's
    reexp={}
    root_text=mods.get('crate','')
    for m in re.finditer(r'pub(?:\(crate\))?\s+use\s+(\w+)::(?:\{([^}]*)\}|(\w+))',root_text):
        names=(m.group(2) or m.group(3)).split(',')
        for n in names:
            n=n.strip().split(' ')[-1].split('::')[-1]
            if n: reexp[n]=m.group(1)
    def resolve(cur,path):
        parts=path.split('::')
        if parts[0]=='crate':
            parts=parts[1:]; mod=[]
            if parts and parts[0] in reexp and parts[0] not in mods: parts=[reexp[parts[0]]]+parts[1:]
        elif parts[0]=='super':
            mod=cur.split('::')[:-1]; parts=parts[1:]
            while parts and parts[0]=='super': mod=mod[:-1]; parts=parts[1:]
        elif parts[0]=='self': mod=cur.split('::'); parts=parts[1:]
        else: return None
        # longest prefix that is a module
        best=None
        for k in range(len(parts),-1,-1):
            cand='::'.join(mod+parts[:k])
            if cand in mods: best=cand;break
        if best is None: best='::'.join(mod) or 'crate'
        return best or 'crate'
    edges=set()
    for name,text in mods.items():
        if name=='crate': continue
        for m in re.finditer(r'\b((?:crate|super|self)(?:::\w+)+)(?:::\{([^}]*)\})?',text):
            tgt=resolve(name,m.group(1))
            targets=[tgt]
            if m.group(2):
                for item in m.group(2).split(','):
                    item=item.strip().split(' ')[0]
                    if item and item!='self':
                        t2=resolve(name,m.group(1)+'::'+item.split('::')[0])
                        targets.append(t2)
            for t in targets:
                if t and t!=name and t!='crate':
                    a,b=name,t
                    if fold: a,b=a.split('::')[0],b.split('::')[0]
                    # parent/child relation (a child using its parent's items) is not a circle between siblings
                    if a!=b: edges.add((a,b))
    # find cycles (SCCs)
    g={}
    for a,b in edges: g.setdefault(a,set()).add(b)
    idx={};low={};st=[];on=set();sccs=[];c=[0]
    sys.setrecursionlimit(10000)
    def sc(v):
        idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
        for w in g.get(v,()):
            if w not in idx: sc(w);low[v]=min(low[v],low[w])
            elif w in on: low[v]=min(low[v],idx[w])
        if low[v]==idx[v]:
            comp=[]
            while True:
                w=st.pop();on.discard(w);comp.append(w)
                if w==v:break
            if len(comp)>1: sccs.append(comp)
    for v in list(g):
        if v not in idx: sc(v)
    found += len(sccs)
    print(f'{crate}: {len(mods)} modules, {len(edges)} edges, circles: {len(sccs)}')
    for comp in sccs:
        print('  SCC:',sorted(comp))
        for a,b in sorted(edges):
            if a in comp and b in comp: print('    ',a,'->',b)
sys.exit(1 if found else 0)
