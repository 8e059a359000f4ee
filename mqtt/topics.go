package mqtt

import (
	"strings"
	"sync"
	"sync/atomic"
)

// subscription is one filter of a session, with its options as the
// SUBSCRIBE carried them.
type subscription struct {
	// filter is the filter as subscribed, "$share/group/…" included: the
	// key of the session's subscriptions.
	filter string
	// match is the filter that is matched against topics, group is the
	// share name ("" for a plain subscription).
	match, group string
	qos          byte
	noLocal      bool
	rap          bool // retain as published
	rh           byte // retain handling
	id           int  // subscription identifier, 0 for none
	// since is the last log index applied when the subscription was made:
	// a replay from the log never hands it older records.
	since uint64
}

// parseShare splits "$share/group/filter" into group and filter; ok is
// false for a plain filter, and for a malformed share (empty group or
// filter, or a group with wildcards), which the caller refuses.
func parseShare(f string) (group, filter string, shared, ok bool) {
	first, rest, cut := strings.Cut(f, "/")
	if !strings.EqualFold(first, "$share") {
		return "", f, false, true
	}
	group, filter, cut2 := strings.Cut(rest, "/")
	if !cut || !cut2 || group == "" || filter == "" || strings.ContainsAny(group, "+#") {
		return "", "", true, false // [MQTT-4.8.2-1] [MQTT-4.8.2-2]
	}
	return group, filter, true, true
}

// validFilter reports whether f is a well-formed topic filter: '#' only
// as the whole last level, '+' only as a whole level [MQTT-4.7.1-2]
// [MQTT-4.7.1-3], no NUL [MQTT-4.7.3-2], not empty [MQTT-4.7.3-1].
func validFilter(f string) bool {
	if f == "" || strings.IndexByte(f, 0) >= 0 {
		return false
	}
	for i := 0; i < len(f); i++ {
		switch f[i] {
		case '#':
			if i != len(f)-1 || (i > 0 && f[i-1] != '/') {
				return false
			}
		case '+':
			if (i > 0 && f[i-1] != '/') || (i < len(f)-1 && f[i+1] != '/') {
				return false
			}
		}
	}
	return true
}

// validTopic reports whether t may be published to: not empty, no
// wildcards [MQTT-3.3.2-2], no NUL. A loop over the bytes: it runs on
// every publish, and strings.ContainsAny builds its set of three each
// time (several times the cost for a short topic).
func validTopic(t string) bool {
	for i := 0; i < len(t); i++ {
		if notInTopic[t[i]] {
			return false
		}
	}
	return t != ""
}

// notInTopic marks the bytes a topic to publish to may not hold.
var notInTopic = [256]bool{'+': true, '#': true, 0: true}

// topicIndex is the tree of every session's subscriptions, by filter
// level, so a committed record finds its subscribers without a scan of
// every session. The applier reads it for each record; subscribe and
// unsubscribe, which are rare, write it.
type topicIndex struct {
	mu   sync.RWMutex // guards the tree
	root *tnode
	// gen moves on every subscription made, so the route cache can tell
	// a topic that had no subscriber when it looked from one that may
	// have gained one.
	gen atomic.Uint64
}

// tnode is one level of the tree.
type tnode struct {
	kids   map[string]*tnode
	subs   map[*session]*subscription
	shared map[string]*shareGroup
}

// shareGroup is the sessions of one share name under one filter: each
// message goes to one of them, round robin among the connected ones.
type shareGroup struct {
	members []*session
	subs    []*subscription
	next    atomic.Uint32
}

func newTopicIndex() *topicIndex { return &topicIndex{root: &tnode{}} }

// add puts sub of s into the tree, replacing an earlier one with the same
// filter.
func (ti *topicIndex) add(s *session, sub *subscription) {
	ti.mu.Lock()
	defer ti.mu.Unlock()
	n := ti.root
	for _, lv := range strings.Split(sub.match, "/") {
		if n.kids == nil {
			n.kids = map[string]*tnode{}
		}
		k := n.kids[lv]
		if k == nil {
			k = &tnode{}
			n.kids[lv] = k
		}
		n = k
	}
	if sub.group == "" {
		if n.subs == nil {
			n.subs = map[*session]*subscription{}
		}
		n.subs[s] = sub
	} else {
		if n.shared == nil {
			n.shared = map[string]*shareGroup{}
		}
		g := n.shared[sub.group]
		if g == nil {
			g = &shareGroup{}
			n.shared[sub.group] = g
		}
		replaced := false
		for i, m := range g.members {
			if m == s {
				g.subs[i], replaced = sub, true
			}
		}
		if !replaced {
			g.members = append(g.members, s)
			g.subs = append(g.subs, sub)
		}
	}
	ti.gen.Add(1)
}

// remove takes sub of s out of the tree, and prunes empty levels.
func (ti *topicIndex) remove(s *session, sub *subscription) {
	ti.mu.Lock()
	defer ti.mu.Unlock()
	levels := strings.Split(sub.match, "/")
	path := make([]*tnode, 0, len(levels)+1)
	n := ti.root
	path = append(path, n)
	for _, lv := range levels {
		n = n.kids[lv]
		if n == nil {
			return
		}
		path = append(path, n)
	}
	if sub.group == "" {
		delete(n.subs, s)
	} else if g := n.shared[sub.group]; g != nil {
		for i, m := range g.members {
			if m == s {
				g.members = append(g.members[:i:i], g.members[i+1:]...)
				g.subs = append(g.subs[:i:i], g.subs[i+1:]...)
				break
			}
		}
		if len(g.members) == 0 {
			delete(n.shared, sub.group)
		}
	}
	for i := len(path) - 1; i > 0; i-- {
		p := path[i]
		if len(p.kids) > 0 || len(p.subs) > 0 || len(p.shared) > 0 {
			break
		}
		delete(path[i-1].kids, levels[i-1])
	}
}

// match calls fn for every subscription matching topic: each plain one,
// and for each share group one member, the next connected one in turn
// (none when no member is connected). A session with several matching
// subscriptions is called once for each.
func (ti *topicIndex) match(topic string, fn func(s *session, sub *subscription)) {
	ti.mu.RLock()
	defer ti.mu.RUnlock()
	walkMatches(ti.root, topic, func(n *tnode) { emit(n, fn) })
}

// any reports whether some subscription, shared ones included, matches
// topic.
func (ti *topicIndex) any(topic string) bool {
	found := false
	ti.mu.RLock()
	defer ti.mu.RUnlock()
	walkMatches(ti.root, topic, func(n *tnode) {
		if len(n.subs) > 0 || len(n.shared) > 0 {
			found = true
		}
	})
	return found
}

// walkMatches calls visit on every node whose filter matches topic.
// Wildcards at the first level do not match topics starting with '$'
// [MQTT-4.7.2-1].
func walkMatches(root *tnode, topic string, visit func(*tnode)) {
	walkLevel(root, topic, !strings.HasPrefix(topic, "$"), visit)
}

func walkLevel(n *tnode, rest string, wild bool, visit func(*tnode)) {
	lv, next, more := strings.Cut(rest, "/")
	if wild {
		if k := n.kids["#"]; k != nil {
			visit(k)
		}
		if k := n.kids["+"]; k != nil {
			walkChild(k, next, more, visit)
		}
	}
	if k := n.kids[lv]; k != nil {
		walkChild(k, next, more, visit)
	}
}

// walkChild goes on below k, the node matching this level: to the next
// level, or, at the topic's last level, k itself and its "#" child ("a/#"
// matches "a", its parent level [MQTT-4.7.1-2]).
func walkChild(k *tnode, next string, more bool, visit func(*tnode)) {
	if more {
		walkLevel(k, next, true, visit)
		return
	}
	visit(k)
	if h := k.kids["#"]; h != nil {
		visit(h)
	}
}

func emit(n *tnode, fn func(*session, *subscription)) {
	for s, sub := range n.subs {
		fn(s, sub)
	}
	for _, g := range n.shared {
		k := len(g.members)
		start := int(g.next.Add(1))
		for i := 0; i < k; i++ {
			j := (start + i) % k
			if g.members[j].online() {
				fn(g.members[j], g.subs[j])
				break
			}
		}
	}
}
