package cli

import (
	"bufio"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/spf13/cobra"
	"gopkg.in/yaml.v3"

	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
)

// Docs that cannot drift (issue #34): the README and docs/*.md are read
// as a newcomer reads them, and every link, config, ACL, users file and
// command line in them is held to what the code takes. The tests live in
// package cli because the command tree (newRoot) is what the command
// lines are checked against.
//
// Conventions a docs writer needs to know:
//   - A ```yaml block is taken for a tandem config when one of its
//     top-level keys is one of tandem.yaml's (node, mqtt, topics, ...); it
//     must then pass config.Parse, the parser `tandem check` and `tandem
//     run` start with (the files it names are not read: they are the
//     reader's). A block that is only part of a config, or a config meant
//     to be refused, starts with the line "# fragment".
//   - A plain ``` block whose lines (comments and blank lines aside) all
//     start with "topic ", "user " or "pattern " is an ACL file and must
//     pass mqtt.ParseACL; one whose lines are all "name:$2…" bcrypt
//     lines is a users file and must pass mqtt.ParseUsers.
//   - docs/configuration.md's key table is generated from
//     config/reference.go and held to the schema by config's tests.
//   - In a ``` block (no language, sh, shell, bash or console), every
//     line that runs tandem (after a "host$ " prompt, sudo, "|", "&&",
//     "$(" or "sh -c '") must name commands and flags the command tree
//     has, and every "make TARGET" a target of the Makefile.

// docFiles are the files a reader is sent to: the README and docs/.
func docFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no docs/*.md")
	}
	return append([]string{"../README.md"}, files...)
}

func readDoc(t *testing.T, f string) string {
	t.Helper()
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// fence is one fenced code block of a markdown file.
type fence struct {
	lang string
	line int // of its first content line
	body []string
}

// splitFences returns a file's fenced blocks and its text with them
// blanked out (line numbers kept), so that links and headings are looked
// for only outside code.
func splitFences(text string) (prose []string, fences []fence) {
	var cur *fence
	for i, l := range strings.Split(text, "\n") {
		trim := strings.TrimSpace(l)
		if strings.HasPrefix(trim, "```") {
			if cur == nil {
				cur = &fence{lang: strings.TrimSpace(strings.TrimPrefix(trim, "```")), line: i + 2}
			} else {
				fences = append(fences, *cur)
				cur = nil
			}
			prose = append(prose, "")
			continue
		}
		if cur != nil {
			cur.body = append(cur.body, l)
			prose = append(prose, "")
			continue
		}
		prose = append(prose, l)
	}
	return prose, fences
}

// githubAnchor is the anchor GitHub gives a heading: lower case, spaces
// to '-', punctuation other than '-' and '_' dropped.
func githubAnchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

var headingRE = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)

// anchors are the heading anchors of a markdown file, with GitHub's -1,
// -2 for repeated ones.
func anchors(prose []string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, l := range prose {
		m := headingRE.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		// Inline code and links keep their text.
		h := strings.NewReplacer("`", "", "*", "").Replace(m[1])
		h = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`).ReplaceAllString(h, "$1")
		a := githubAnchor(h)
		if n := seen[a]; n > 0 {
			out[a+"-"+strconv.Itoa(n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

var linkRE = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)

// Every relative link of the README and docs/ names a file of the tree,
// and every #anchor a heading of the file it points into: a section
// renamed or moved fails here instead of sending a reader nowhere.
func TestDocsLinksResolve(t *testing.T) {
	files := docFiles(t)
	anchorsOf := map[string]map[string]bool{}
	proseOf := map[string][]string{}
	for _, f := range files {
		prose, _ := splitFences(readDoc(t, f))
		proseOf[filepath.Clean(f)] = prose
		anchorsOf[filepath.Clean(f)] = anchors(prose)
	}
	links := 0
	for _, f := range files {
		for i, l := range proseOf[filepath.Clean(f)] {
			// Inline code is no link.
			l = regexp.MustCompile("`[^`]*`").ReplaceAllString(l, "")
			for _, m := range linkRE.FindAllStringSubmatch(l, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				links++
				file, anchor, _ := strings.Cut(target, "#")
				dest := filepath.Clean(f)
				if file != "" {
					dest = filepath.Clean(filepath.Join(filepath.Dir(f), file))
					if _, err := os.Stat(dest); err != nil {
						t.Errorf("%s:%d: link %q: %v", f, i+1, target, err)
						continue
					}
				}
				if anchor == "" {
					continue
				}
				as, ok := anchorsOf[dest]
				if !ok {
					if !strings.HasSuffix(dest, ".md") {
						t.Errorf("%s:%d: link %q: an anchor into a file that is not markdown", f, i+1, target)
						continue
					}
					prose, _ := splitFences(readDoc(t, dest))
					as = anchors(prose)
					anchorsOf[dest] = as
				}
				if !as[anchor] {
					t.Errorf("%s:%d: link %q: %s has no heading with anchor #%s", f, i+1, target, dest, anchor)
				}
			}
		}
	}
	if links < 20 {
		t.Errorf("only %d relative links found: is the link pattern still right?", links)
	}
}

func TestGithubAnchor(t *testing.T) {
	for h, want := range map[string]string{
		"When a gateway's storage is damaged":  "when-a-gateways-storage-is-damaged",
		"Running a cluster of 2 or 3 gateways": "running-a-cluster-of-2-or-3-gateways",
		"What an ack means":                    "what-an-ack-means",
		"Limits and budgets: `mqtt.*`":         "limits-and-budgets-mqtt",
	} {
		if got := githubAnchor(strings.ReplaceAll(h, "`", "")); got != want {
			t.Errorf("anchor of %q = %q, want %q", h, got, want)
		}
	}
}

// configTopKeys are tandem.yaml's top-level keys.
func configTopKeys() map[string]bool {
	out := map[string]bool{}
	t := reflect.TypeOf(config.Config{})
	for i := range t.NumField() {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ","); name != "" && name != "-" {
			out[name] = true
		}
	}
	return out
}

// Every tandem config in the docs is one `tandem check` takes, and so is
// testdata/config/full.yaml and the packaged config; testdata's bad-*.yaml
// are refused.
func TestDocsConfigsParse(t *testing.T) {
	top := configTopKeys()
	checked := 0
	for _, f := range docFiles(t) {
		_, fences := splitFences(readDoc(t, f))
		for _, fc := range fences {
			if fc.lang != "yaml" && fc.lang != "yml" {
				continue
			}
			if len(fc.body) > 0 && strings.TrimSpace(fc.body[0]) == "# fragment" {
				continue
			}
			text := strings.Join(fc.body, "\n") + "\n"
			var doc map[string]any
			if err := yaml.Unmarshal([]byte(text), &doc); err != nil {
				t.Errorf("%s:%d: a yaml block that is no YAML mapping: %v", f, fc.line, err)
				continue
			}
			tandem := false
			for k := range doc {
				tandem = tandem || top[k]
			}
			if !tandem {
				continue // another tool's (Prometheus)
			}
			checked++
			if _, err := config.Parse([]byte(text), f+" (block at line "+strconv.Itoa(fc.line)+")"); err != nil {
				t.Errorf("%s: the config block at line %d is refused:\n%v", f, fc.line, err)
			}
		}
	}
	if checked < 3 {
		t.Errorf("only %d config blocks found in the docs", checked)
	}
	for _, f := range []string{"../testdata/config/full.yaml", "../packaging/tandem.yaml"} {
		if _, err := config.Parse([]byte(readDoc(t, f)), f); err != nil {
			t.Errorf("%s is refused:\n%v", f, err)
		}
	}
	bad, _ := filepath.Glob("../testdata/config/bad-*.yaml")
	for _, f := range bad {
		if _, err := config.Parse([]byte(readDoc(t, f)), f); err == nil {
			t.Errorf("%s is a bad config's fixture, and is taken", f)
		}
	}
}

// Every ACL and users-file example in the docs is one the gateway takes.
func TestDocsACLAndUsersExamplesParse(t *testing.T) {
	aclLine := regexp.MustCompile(`^(topic|user|pattern)\s`)
	usersLine := regexp.MustCompile(`^[^:\s#]+:\$2[aby]?\$`)
	acls := 0
	for _, f := range docFiles(t) {
		_, fences := splitFences(readDoc(t, f))
		for _, fc := range fences {
			if fc.lang != "" {
				continue
			}
			allACL, allUsers, any := true, true, false
			for _, l := range fc.body {
				l = strings.TrimSpace(l)
				if l == "" || strings.HasPrefix(l, "#") {
					continue
				}
				any = true
				allACL = allACL && aclLine.MatchString(l)
				allUsers = allUsers && usersLine.MatchString(l)
			}
			text := strings.Join(fc.body, "\n") + "\n"
			switch {
			case !any:
			case allACL:
				acls++
				if _, err := mqtt.ParseACL(strings.NewReader(text), f+" (block at line "+strconv.Itoa(fc.line)+")"); err != nil {
					t.Errorf("%s: the ACL at line %d does not parse: %v", f, fc.line, err)
				}
			case allUsers:
				if _, err := mqtt.ParseUsers(strings.NewReader(text), f+" (block at line "+strconv.Itoa(fc.line)+")"); err != nil {
					t.Errorf("%s: the users file at line %d does not parse: %v", f, fc.line, err)
				}
			}
		}
	}
	if acls == 0 {
		t.Error("no ACL example found in the docs (docs/security.md has one)")
	}
}

var (
	promptRE = regexp.MustCompile(`^[\w.-]+\$\s+`)
	// Where a tandem command line starts within a shell line.
	tandemRE = regexp.MustCompile(`(?:^|[|&;(]\s*|\$\(|sudo\s+(?:-\S+\s+)*|sh -c ')(?:\./bin/|/usr/bin/|/usr/local/bin/)?tandem\s+([^|;&#'>)]*)`)
	makeRE   = regexp.MustCompile(`(?:^|[\s;&|])make\s+([A-Za-z][\w-]*)`)
)

// Every `tandem COMMAND --flag` and `make TARGET` in a shell block of the
// docs exists: a renamed flag or command fails here, not on a reader's
// gateway.
func TestDocsCommandLinesExist(t *testing.T) {
	root := newRoot(nil, nil)
	targets := makeTargets(t)
	lines := 0
	for _, f := range docFiles(t) {
		_, fences := splitFences(readDoc(t, f))
		for _, fc := range fences {
			if !slices.Contains([]string{"", "sh", "shell", "bash", "console"}, fc.lang) {
				continue
			}
			for i, l := range fc.body {
				l = promptRE.ReplaceAllString(strings.TrimSpace(l), "")
				if strings.HasPrefix(l, "#") {
					continue
				}
				for _, m := range makeRE.FindAllStringSubmatch(l, -1) {
					if !targets[m[1]] {
						t.Errorf("%s:%d: make %s: the Makefile has no such target", f, fc.line+i, m[1])
					}
				}
				for _, m := range tandemRE.FindAllStringSubmatch(l, -1) {
					lines++
					if err := checkCommandLine(root, m[1]); err != nil {
						t.Errorf("%s:%d: tandem %s: %v", f, fc.line+i, strings.TrimSpace(m[1]), err)
					}
				}
			}
		}
	}
	// And in the prose: `tandem pair join CODE --addr HOST:PORT`.
	span := regexp.MustCompile("`((?:\\./bin/|sudo )?tandem [^`]*)`")
	for _, f := range docFiles(t) {
		prose, _ := splitFences(readDoc(t, f))
		for i, l := range prose {
			for _, s := range span.FindAllStringSubmatch(l, -1) {
				for _, m := range tandemRE.FindAllStringSubmatch(s[1], -1) {
					lines++
					if err := checkCommandLine(root, m[1]); err != nil {
						t.Errorf("%s:%d: tandem %s: %v", f, i+1, strings.TrimSpace(m[1]), err)
					}
				}
			}
		}
	}
	t.Logf("%d tandem command lines checked", lines)
	if lines < 40 {
		t.Errorf("only %d tandem command lines found in the docs", lines)
	}
}

// checkCommandLine walks args down the command tree and checks every
// flag on the command it reaches.
func checkCommandLine(root *cobra.Command, args string) error {
	cmd := root
	words := strings.Fields(strings.NewReplacer("[", " ", "]", " ").Replace(args))
	i := 0
	for ; i < len(words); i++ {
		w := words[i]
		if strings.HasPrefix(w, "-") {
			break
		}
		var next *cobra.Command
		for _, c := range cmd.Commands() {
			if c.Name() == w || slices.Contains(c.Aliases, w) {
				next = c
			}
		}
		if next == nil {
			break // an argument
		}
		cmd = next
	}
	if cmd == root {
		if len(words) == 0 {
			return nil
		}
		return errUnknown("command " + words[0])
	}
	if strings.Contains(cmd.Use, "|") && cmd.HasSubCommands() && i < len(words) && !strings.HasPrefix(words[i], "-") {
		// "service install|uninstall|…": every alternative must be one.
		for _, alt := range strings.Split(words[i], "|") {
			if cmd.Commands() != nil && !slices.ContainsFunc(cmd.Commands(), func(c *cobra.Command) bool { return c.Name() == alt }) {
				return errUnknown("command " + cmd.CommandPath() + " " + alt)
			}
		}
	}
	for _, w := range words[i:] {
		if !strings.HasPrefix(w, "-") || w == "-" || w == "--" {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimLeft(w, "-"), "=")
		var found bool
		if strings.HasPrefix(w, "--") {
			found = cmd.Flags().Lookup(name) != nil || cmd.InheritedFlags().Lookup(name) != nil
		} else {
			found = cmd.Flags().ShorthandLookup(name[:1]) != nil || cmd.InheritedFlags().ShorthandLookup(name[:1]) != nil
		}
		if !found && (name == "help" || name == "h") {
			found = true
		}
		if !found {
			return errUnknown("flag " + w + " of " + cmd.CommandPath())
		}
	}
	return nil
}

type errUnknown string

func (e errUnknown) Error() string { return "no " + string(e) }

// makeTargets are the Makefile's targets.
func makeTargets(t *testing.T) map[string]bool {
	t.Helper()
	f, err := os.Open("../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]bool{}
	target := regexp.MustCompile(`^([A-Za-z][\w-]*(?:\s+[A-Za-z][\w-]*)*)\s*:([^=]|$)`)
	s := bufio.NewScanner(f)
	for s.Scan() {
		if m := target.FindStringSubmatch(s.Text()); m != nil {
			for _, n := range strings.Fields(m[1]) {
				out[n] = true
			}
		}
	}
	return out
}
