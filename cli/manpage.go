package cli

import (
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// The man page, tandem(1), is generated from the command tree, so that it
// lists every command and flag `tandem --help` does: written by hand, it
// had fallen behind (no status, cluster, promote, pair or bench). `make
// man` writes packaging/tandem.1 with the hidden `tandem man`, and a test
// fails when the file and the commands disagree. cobra/doc would do it with
// go-md2man, a dependency for a page this size; the roff below is all it
// takes. The sections that are not about commands are kept here.

const manHeader = `.TH TANDEM 1 "" "tandem" "User Commands"
.SH NAME
tandem \- durable, replicated MQTT gateway for edge devices
`

const manDescription = `.SH DESCRIPTION
.B tandem
is an MQTT broker (MQTT 3.1.1 and 5) for edge gateways that never acknowledges
a publish it could lose: every publish is written to a crash\-safe local log
before its PUBACK, and replicated from master to slave across two or three
gateways, with synchronous or asynchronous acknowledgement chosen per topic.
.PP
The package runs it as the systemd service
.BR tandem.service ,
as the system user
.BR tandem ,
with the configuration in
.I /etc/tandem/tandem.yaml
and its log in
.IR /var/lib/tandem .
Commands that act on the running gateway (status, cluster, promote, pair)
reach it over its HTTP listener, 127.0.0.1:7880 unless configured.
`

const manFooter = `.PP
.B tandem help
lists every command and
.B tandem
.I COMMAND
.B \-\-help
describes one.
.SH EXIT STATUS
0 on success (a clean stop included), 1 on a runtime failure, 2 on a usage or
configuration error.
.SH FILES
.TP
.I /etc/tandem/tandem.yaml
the configuration (a conffile, commented)
.TP
.I /etc/default/tandem
extra arguments for
.B tandem run
.RB ( TANDEM_OPTS )
and the Go runtime's environment
.TP
.I /var/lib/tandem
the log of every publish, the node key, the HTTP API token
.RI ( http-token )
and its metadata; kept when the package is removed, deleted when it is purged.
Files an administrator added to
.I /etc/tandem
(users, ACLs, keys) are kept on purge too, and purge lists them
.SH SEE ALSO
.BR systemctl (1),
.BR journalctl (1)
`

// newManCmd is the hidden `tandem man`: the man page on stdout.
func newManCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "man",
		Short:  "Print the man page tandem(1), generated from the commands (make man)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return writeManPage(cmd.OutOrStdout(), cmd.Root())
		},
	}
}

// writeManPage writes tandem(1) for root's command tree.
func writeManPage(w io.Writer, root *cobra.Command) error {
	var b strings.Builder
	b.WriteString(manHeader)
	cmds := manCommands(root)
	b.WriteString(".SH SYNOPSIS\n")
	for i, c := range cmds {
		if p := c.Parent(); p != root && p.Runnable() {
			continue // the parent's synopsis names it (tandem service install|...)
		}
		if i > 0 {
			b.WriteString(".br\n")
		}
		fmt.Fprintf(&b, ".B %s\n", roff(c.CommandPath()))
		if args := useArgs(c); args != "" {
			fmt.Fprintf(&b, ".I %s\n", roff(args))
		}
		if c.NonInheritedFlags().HasAvailableFlags() {
			b.WriteString(".RI [ options ]\n")
		}
	}
	b.WriteString(manDescription)
	b.WriteString(".SH COMMANDS\n")
	for _, c := range cmds {
		fmt.Fprintf(&b, ".SS \"%s\"\n", roff(strings.TrimSpace(c.CommandPath()+" "+useArgs(c))))
		text := c.Long
		if text == "" {
			text = c.Short
		}
		writeText(&b, text)
		if c.Example != "" {
			b.WriteString(".PP\nExamples:\n")
			writeText(&b, c.Example)
		}
		c.NonInheritedFlags().VisitAll(func(f *pflag.Flag) {
			if f.Hidden || f.Name == "help" {
				return
			}
			b.WriteString(".TP\n")
			name, usage := pflag.UnquoteUsage(f)
			line := `\fB\-\-` + roff(f.Name) + `\fR`
			if f.Shorthand != "" {
				line = `\fB\-` + roff(f.Shorthand) + `\fR, ` + line
			}
			if name != "" {
				line += ` \fI` + roff(name) + `\fR`
			}
			b.WriteString(line + "\n")
			if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" && f.DefValue != "0s" && f.DefValue != "[]" {
				usage += " (default " + f.DefValue + ")"
			}
			b.WriteString(roffLine(usage) + "\n")
		})
	}
	b.WriteString(manFooter)
	_, err := io.WriteString(w, b.String())
	return err
}

// manCommands lists the commands a user runs, depth first in the order
// `tandem help` shows them: the runnable ones, without help, completion
// or hidden commands.
func manCommands(c *cobra.Command) []*cobra.Command {
	var out []*cobra.Command
	for _, sub := range c.Commands() {
		if !sub.IsAvailableCommand() || sub.Name() == "help" || sub.Name() == "completion" {
			continue
		}
		if sub.Runnable() {
			out = append(out, sub)
		}
		out = append(out, manCommands(sub)...)
	}
	return out
}

// useArgs is what Use says after the command's name: "TOKEN", "--data DIR".
func useArgs(c *cobra.Command) string {
	_, args, _ := strings.Cut(c.Use, " ")
	return args
}

// writeText writes help text as roff: a blank line starts a paragraph,
// and indented lines (examples) are kept as they are.
func writeText(b *strings.Builder, text string) {
	b.WriteString(".PP\n")
	verbatim := false
	for _, l := range strings.Split(strings.TrimRight(text, "\n"), "\n") {
		indented := strings.HasPrefix(l, " ") || strings.HasPrefix(l, "\t")
		switch {
		case strings.TrimSpace(l) == "":
			if verbatim {
				b.WriteString(".fi\n")
				verbatim = false
			}
			b.WriteString(".PP\n")
			continue
		case indented && !verbatim:
			b.WriteString(".nf\n")
			verbatim = true
		case !indented && verbatim:
			b.WriteString(".fi\n")
			verbatim = false
		}
		if verbatim {
			l = strings.TrimLeft(l, " \t")
		}
		b.WriteString(roffLine(l) + "\n")
	}
	if verbatim {
		b.WriteString(".fi\n")
	}
}

// roffLine escapes one line of text, and guards a line that would read
// as a roff request.
func roffLine(s string) string {
	s = roff(s)
	if strings.HasPrefix(s, ".") || strings.HasPrefix(s, "'") {
		s = `\&` + s
	}
	return s
}

// roffEscapes turn what roff would misread, or render as a minus sign's
// cousin, into its escapes; the typographic characters of the help texts
// get groff's names so the page needs no particular encoding.
var roffEscapes = strings.NewReplacer(
	`\`, `\e`,
	"-", `\-`,
	"→", `\(->`,
	"←", `\(<-`,
	"×", `\(mu`,
	"—", `\(em`,
	"–", `\(en`,
	"…", "...",
	"≤", `\(<=`,
	"≥", `\(>=`,
)

func roff(s string) string { return roffEscapes.Replace(s) }
